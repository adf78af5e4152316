"""`python -m radixserve.experiment`."""

import sys

from radixserve.experiment.cli import main

sys.exit(main())
