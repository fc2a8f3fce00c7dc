"""Use cases, one module per verb: a typed request in, a typed result out, no printing."""
