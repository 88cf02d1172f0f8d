"""Offline stand-in for @rules_cc//cc:defs.bzl: forwards each rule to the native one.

Bazel 4.2.3's own @bazel_tools BUILD files `load("@rules_cc//cc:defs.bzl", ...)`; the real
rules_cc 0.0.x is itself a thin wrapper over these native rules, so forwarding keeps the
behaviour. See third_party/bazel/README.md.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)
