from disagg.bench.cli import main

raise SystemExit(main())
