"""Built-in synthetic tasks (question generators, tool schemas, answer checks) shared by the
bundled dataset, rewards and the tiny-model training script. See `arithmetic.py`."""
