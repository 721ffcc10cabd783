"""SHARED decision core, imported by both processes: the healing policy (a validated data
file), the per-MPU state machine, the engine (conditions in, decisions out) and the
actions (one module each, declaring what the engine needs to know about them).

May import: findings, config, link, textfile. Never imports daemon; never imports torch at
module level (actions that touch a model import it inside their functions).
"""
