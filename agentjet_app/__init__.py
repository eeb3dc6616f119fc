"""agentjet_app: the app layer (the `agentjet` CLI, `agentjet local`, the dashboard, plots).

It sits above the others and may import any of them: agentjet (the kernel), node (the
swarm's roles), sandboxes and coordinator. None of them imports it.

    cli.py         `agentjet ...`: the argparse table and the dispatch
    cli_run.py     `agentjet local|node|coordinator|eval`: the config resolved, roles run
    cli_status.py  `agentjet status`; cli_keys.py `agentjet keys`
    cli_tools.py   `agentjet tasks|agent|dashboard|sandbox`
    local.py       `agentjet local`: every role on this box, as separate processes
    dashboard/     `agentjet dashboard`: a run dir or a live swarm in a browser
    plot.py        `agentjet plot`: a run's curves as PNGs
"""
