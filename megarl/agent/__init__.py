"""Multi-turn tool use: the agent loop over the trajectory runner (loop.py), tool specs and
built-ins (tools.py), their worker processes (executor.py), call parsers (parsers.py, and
tasks.py for the project's own tasks). See docs/agents.md."""
