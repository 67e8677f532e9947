from scaletrain.cli import main

raise SystemExit(main())
