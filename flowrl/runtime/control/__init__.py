"""The controller and its parts: executor threads on the version clock, channels, the ledger, how a run stops."""
