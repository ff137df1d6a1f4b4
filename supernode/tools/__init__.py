"""Operations built on the core: offline preview, policy check, manifests, AWS preflight and verify."""
