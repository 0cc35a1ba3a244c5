"""``python -m hetmoe``: the command line, as the ``hetmoe`` script (and ``torchrun -m hetmoe ...``)."""

from .cli.main import main

raise SystemExit(main())
