"""Moving a conversation's KV cache between llama.cpp replicas before its replica leaves.

slotfiles: slot files and the manifest that keeps a slot out of a replica of another shape;
llama: llama.cpp's /slots, /detokenize and /apply-template; openings: a slot's text back to the
router's conversation key; planner: which conversations are worth moving, and where (pure);
migrate: the drain, save, restore and the routers told (the stack's and Kubernetes' side);
sidecar: a replica's own slot folder served to its peers; drain_k8s: a Kubernetes pod's sidecar
and its drain; settings: [migration] and [sidecar].
"""
