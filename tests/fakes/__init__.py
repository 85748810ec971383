"""Fakes of remote services the tests talk to: an Azure Files REST server and Azure ML responses."""
