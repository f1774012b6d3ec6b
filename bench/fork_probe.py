"""Which import poisons fork on a GPU machine (a probe for bench/gpu_check.py's check 2; not part of the kit)."""
import os
import sys
import torch
import labkit  # noqa: F401
from labkit.run import cuda_guard
steps = [("labkit", lambda: None), ("transformers GPT-2", lambda: __import__("transformers").GPT2LMHeadModel),
         ("deepseek_v3", lambda: __import__("transformers.models.deepseek_v3.modeling_deepseek_v3"))]
for name, step in steps:
    step()
    pid = os.fork()
    if pid == 0:
        try:
            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda")
            os._exit(0)
        except Exception as exc:  # noqa: BLE001
            print("   child:", str(exc)[:100])
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(f"after {name}: torchao loaded {'torchao' in sys.modules}, initialised {torch.cuda.is_initialized()}, "
          f"culprit {cuda_guard.cuda_init_culprit()!r:.80}, fork child {'ok' if status == 0 else 'FAILED'}", flush=True)
