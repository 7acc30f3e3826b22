"""Agentic GRPO: tools the model calls during a rollout, the scenarios it is trained on, and the checks that
score a finished rollout.

- `retrograd.agent.tools`: `[[agent.servers]]` parsing and `ToolBox`, one synchronous front for MCP servers
  (stdio or streamable HTTP) and plain Python function tools, every call bounded in time and output size.
- `retrograd.agent.mcp_client`: the MCP side of the ToolBox (sessions on an asyncio loop in one background thread).
- `retrograd.agent.scenarios`: scenario JSONL files (`{"task": ..., "verify": ..., "answer": ...}` per line).
- `retrograd.agent.verify`: verify specs evaluated over a rollout's final answer and state, and fresh per-rollout
  copies of the state template.
"""
