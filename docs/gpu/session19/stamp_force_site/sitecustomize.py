"""Both probe sites at once for steps_probe.py: session 16's daemon-side timestamps
(docs/gpu/session16/probe_site, PROBE_TIMES=<file>) and this session's forced urgent path
(force_site, FORCE_URGENT_PATH=express|dma). Only one sitecustomize module is imported."""
import os

_here = os.path.dirname(os.path.abspath(__file__))
for _site in (os.path.join(_here, "..", "force_site", "sitecustomize.py"), os.path.join(_here, "..", "..", "session16", "probe_site", "sitecustomize.py")):
    with open(_site) as _f:
        exec(compile(_f.read(), _site, "exec"))
