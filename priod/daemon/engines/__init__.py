"""Copy engine backends behind one interface (`base.Engine`): `sim` everywhere, `cuda` on a GPU.
The daemon picks one at start (`priod.daemon.server.make_engine`)."""
