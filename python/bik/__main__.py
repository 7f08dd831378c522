from bik.cli.main import main

raise SystemExit(main())
