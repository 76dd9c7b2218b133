"""Inside a rank: what the ``course/`` scripts import. Never imports ``helpers.launch`` or ``helpers.notebook``."""
