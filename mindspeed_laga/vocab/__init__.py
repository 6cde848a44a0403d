"""The shared vocabulary: names, sizes and position arithmetic, free of torch.

The core, the cost model, the CLI and the host adapters all speak in these
terms, so each rule is written once, one concern a module:

- ``names``: the choices a caller makes (forms, CP algorithms, layouts, kernels);
- ``dims``: the MLA sizes of one TP rank and of the whole model;
- ``segments``: which global positions each CP rank holds (the chunk rule, segments);
- ``documents``: packed documents' boundaries;
- ``keys``: which keys a segment can see, and key blocks;
- ``blocks``: the blockwise walk's row blocks;
- ``attn_setup``: :class:`AttnSetup`, everything a form needs besides the tensors.

See docs/DESIGN.md, sections "Layouts" and "Causal masks and key prefixes".
"""
