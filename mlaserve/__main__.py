"""python -m mlaserve -> cli.main"""

import sys

from .cli import main

sys.exit(main())
