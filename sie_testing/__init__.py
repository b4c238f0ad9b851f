"""Test doubles and harnesses for SIE's tests and benchmarks only: never imported by the product packages
(an import-linter contract holds that). Each module is named for what it stands in for."""
