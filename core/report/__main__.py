"""``python -m core.report``: see :mod:`core.report.study`."""

from core.report.study import main

raise SystemExit(main())
