from priod.cli import main

raise SystemExit(main())
