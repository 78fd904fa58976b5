"""`python -m fedtrain` is the `fedtrain` command."""

import sys

from fedtrain.cli import main

sys.exit(main())
