"""What a program uses to take part in its own checkpoints (re-exported by `ckpt`):

- checkpoint.py  ckpt.checkpoint(), before_checkpoint/after_restore callbacks, the wait
- results.py     the result file through which a dumper answers the process that asked
- sections.py    ckpt.no_checkpoint(): critical sections that dumps wait for
- journal.py     ckpt.journal: a durable record of irreversible actions
- protocol.py    the CKPT_SOCKET line protocol of `ckpt run`

Imported on first use only: `import ckpt` stays cheap for programs that never call it.
"""
