"""`python -m train --config PATH [key=value ...]`: run one training rank."""

import sys

from train.worker import main

sys.exit(main())
