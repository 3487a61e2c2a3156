"""The client's rounds, one module per shape of exchange: decoded inputs in, plain results out. No Flower types
here, so each round can be called directly in tests and benchmarks; ``client_app.app`` only decodes and encodes
messages.

- ``weights``: a weight-exchanging local round (every averaging strategy: the FedSSL family, FedEMA, FedU,
  L-DAWA, FedX, Orchestra, FedU2, the centralized reference), around the strategy's client rule
  (``client_app/rules/``);
- ``similarity``: FLESD's round (local SSL, then the similarity matrix of the public set);
- ``kernel``: Hetero-SSFL's round (local SSL aligned to the server's kernel, then the client's RAD kernel);
- ``layerwise``: the layer-wise strategies' round (LW-FedSSL, Prog-FedSSL, FedMoCo-LW, FLL+DD);
- ``resources``: the per-step FLOPs and memory every round reports, kept per process and on the node's disk;
- ``public_set``: the check that a client's public set (FLESD's, Hetero-SSFL's RAD) is the server's.
"""
