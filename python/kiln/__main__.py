"""``python -m kiln`` runs the demo."""

import sys

from .cli import main

sys.exit(main())
