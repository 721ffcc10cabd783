"""SHARED decision core, imported by both processes: the healing policy (a validated data
file), the per-MPU state machine, the engine (conditions in, decisions out) and the actions'
specs (what the engine and the policy know of each action; what an action does to a model is
its executor, mscale.hook.fuse.actions, in the training job).

May import: findings, options (the config machinery), link, textfile. Never imports daemon, torch or a job-side room
(hook, snapshot), by any route: the agent loads all of it without torch
(tests/test_layout.py, tests/test_agent_torchless.py).
"""
