"""agentjet: a swarm-style peer-to-peer RL trainer for LLM agents (shared kernel)."""

__version__ = "0.1.0"
