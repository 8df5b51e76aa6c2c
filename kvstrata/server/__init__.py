"""The HTTP front end of one rank: OpenAI-compatible and native endpoints over an engine
driven by its own thread (`kvstrata serve`)."""
