"""The engine-thread bridge of a rank: the engine thread and its command queue
(`EngineLoop`), request groups and their errors, and the end of a rank whose engine failed."""
