"""`decodectl`: the one command line for the engine, the proxy, the operator and the tools."""
