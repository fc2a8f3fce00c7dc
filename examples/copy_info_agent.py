"""Which copy am I: run it, checkpoint it, then 'ckpt clone ID --copies 4' (docs/api.md)."""
import ckpt

result = ckpt.checkpoint(name="agent")
if result.restored and result.copy is not None:
    print(f"copy {result.copy} of checkpoint {result.id}")   # 1..N
info = ckpt.copy_info()   # None in the original and in plain restores
# {"format": 1, "clone": "20261130-231500-000-abcdef", "copy": 2, "copies": 4,
#  "checkpoint": "20261130-230102-123-3fa9c1", "name": "agent", "created": "2026-11-30T23:15:00+00:00"}
print(info)
