import sys

from pretrain.bench import main

sys.exit(main())
