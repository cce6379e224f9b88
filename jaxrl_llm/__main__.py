"""``python -m jaxrl_llm``: the ``jaxrl-llm`` command line (:mod:`jaxrl_llm.cli`)."""

from jaxrl_llm.cli import main

raise SystemExit(main())
