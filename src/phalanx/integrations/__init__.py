"""phalanx inside other engines, for what you may want to call by hand.

`phalanx.integrations.ray`: Ray Train (docs/ray.md). The Trainer needs nothing
from here (it finds Ray Train itself); a hand-written loop and the driver may.
Nothing here is imported by `import phalanx`, and nothing imports its engine
before a function that needs it runs: each engine is an extra
(`pip install phalanx[ray]`), never a dependency.
"""
