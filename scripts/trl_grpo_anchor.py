"""The RL anchor: TRL's GRPOTrainer on the CPU doing the grpo-arith workload (4 prompts x 8
completions x up to 24 new tokens, beta 0.04, LoRA r16 on 7 targets, SmolLM2 from the GGUF
dequantized to fp32). Run with a Python that has torch, transformers, peft and trl:

    .venv-torch/bin/python scripts/trl_grpo_anchor.py MODEL.gguf [STEPS]

Prints the median seconds per step (after one warm-up step).
"""

import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count())))
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
d, f = os.path.split(os.path.abspath(path))
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
# the GGUF loader marks the model as quantized although its weights are now fp32
for attr in ("hf_quantizer", "quantization_method"):
    if hasattr(model, attr):
        setattr(model, attr, None)
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
records = [json.loads(x) for x in open(os.path.join(root, "examples/grpo-arith/train.jsonl"))]
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in records])


def reward(completions, answer, **_):
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        nums = re.findall(r"-?\d+", text)
        out.append((1.0 if nums and nums[-1] == a else 0.0) + (0.5 if re.fullmatch(r"\d+", text.strip()) else 0.0))
    return out


times = []


class Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t)


cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=32, num_generations=8,
                 max_completion_length=24, beta=0.04, learning_rate=2e-4, max_steps=steps + 1, logging_steps=1,
                 use_cpu=True, report_to=[], save_strategy="no", temperature=1.0, bf16=False)
trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds, processing_class=tok,
                      callbacks=[Timer()],
                      peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
trainer.train()
print(f"trl GRPOTrainer cpu: {statistics.median(times[1:]):.2f} s per step (median of {len(times) - 1}), "
      f"threads {torch.get_num_threads()}")
