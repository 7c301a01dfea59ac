from nanojax.cli import main

raise SystemExit(main())
