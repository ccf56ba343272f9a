"""``python -m meshkit.plan --help``: plan a training job for hardware you do not have."""

import sys

from meshkit.plan._cli import main

sys.exit(main())
