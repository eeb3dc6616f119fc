"""`agentjet dashboard`: a run's (or a live swarm's) metrics, nodes, scheduler and
trajectories in a browser, live.

    reader.py   the run dir's files, read incrementally and bounded (no torch, no node/*)
    source.py   the data source interface; RunDirSource (a run dir)
    swarm.py    SwarmSource (a live swarm: directory, MetricsRequest; imports node/ lazily)
    server.py   the aiohttp app: read-only JSON under /api, the page under /
    static/     index.html, app.js (polling, canvas charts, scheduler, token viewer), style.css

This module imports nothing heavy: `agentjet local` uses it to print the URL.
"""

from __future__ import annotations


def dashboard_url(host: str, port: int, token: str = "") -> str:
    """The address to open; with the token in it when there is one."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
