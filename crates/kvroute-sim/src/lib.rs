//! kvroute-sim library (placeholder).
