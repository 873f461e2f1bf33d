"""ditruntime: the runtime both services share (logging, metrics exposition, the one error->status
mapping, fault points, paths, the service main loop, the slab contract). Below the services,
above the model core and the generated protos."""
