"""The model behind one interface (`Backend`): resident and cached mode, what the cached mode needs from the
sidecar (`SidecarSession`) and its gRPC client."""
