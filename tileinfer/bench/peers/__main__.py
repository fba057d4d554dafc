import sys

from tileinfer.bench.peers.bench import main

sys.exit(main())
