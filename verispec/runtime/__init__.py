"""What a step runs on: the model runner, the paged KV cache (blocks, block tables), the recurrent
state of hybrid models and CUDA graphs. Below ``engine/`` and ``proposers/``: both import it."""
