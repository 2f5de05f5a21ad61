"""Chat turns as token ids: the chat template's rendering of what is appended between turns
(:mod:`rlcore.chat.templates`) and the tool calls an assistant completion makes (:mod:`rlcore.chat.tool_calls`).

Light on import: nothing here imports torch or transformers at module level.
"""
