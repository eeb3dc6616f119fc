"""The project's small exception hierarchy. Messages tell the user what to do."""


class AgentjetError(Exception):
    """Base of every error agentjet raises on purpose."""


class ConfigError(AgentjetError):
    """A config file, override or argument is wrong; the message names the key."""


class TaskFileError(AgentjetError):
    """A task file row is malformed; the message names the file and line."""


class ProtocolError(AgentjetError):
    """A peer sent a message that does not decode or breaks the protocol."""


class ModelError(AgentjetError):
    """A model cannot be found, converted or loaded."""


class EngineError(AgentjetError):
    """An inference engine's own processes failed (vLLM's engine core died)."""
