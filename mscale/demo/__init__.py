"""DEMO (`mscale demo`): an embedded agent on a simulated node and a tiny multimodal model
trained on CPU in this process, with faults injected through the agent's chaos API.

The one room that runs both halves. May import: everything.
"""
