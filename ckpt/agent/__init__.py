"""ckpt.agent: what a program uses from inside (see docs/design.md "Agent API")."""
