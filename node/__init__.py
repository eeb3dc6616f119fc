"""The swarm's nodes: rollout, trainer, teacher and their parts."""

import os

# hivemind shares tensors between its processes through files in /dev/shm by default; a
# process killed with SIGKILL leaves them there, in memory, until reboot. File descriptors
# die with the process. (Read by hivemind when it is first imported: set here, before any
# node module imports it.)
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
