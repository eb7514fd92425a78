"""The public gRPC API's server-side helpers: request validation, rich errors, served-model loading."""
