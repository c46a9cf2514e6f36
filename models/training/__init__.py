"""Training of drafter heads (needs the ``train`` extra: torch).

* ``eagle3_data``  recording target features and distributions (generation, teacher-forced text)
* ``eagle3_torch`` the EAGLE-3 head in torch, term for term as llama.cpp's eagle3 graph
* ``eagle3_train`` the trainer (training-time test, held-out split, GGUF export)

The runtime side of ``localspec.models`` (registry, GGUF editing, head writing) never imports
this package, so the runtime does not need torch.
"""
