//! A backend that is compiled in but set up wrong is an error, never a silent move to
//! another backend. Its own test binary: it sets the process's environment.

#[test]
#[cfg_attr(not(feature = "nccl"), ignore = "built without the nccl feature")]
fn a_malformed_nccl_setting_is_an_error_not_a_fall_back_to_cpu() {
    std::env::remove_var("ANYCCL_BACKEND");
    std::env::set_var("ANYCCL_NCCL_BLOCKING", "yes");
    let got = anyccl::pick_backend(None).map(|b| b.name());
    std::env::remove_var("ANYCCL_NCCL_BLOCKING");
    let e = got.expect_err("the nccl backend is compiled in and set up wrong").to_string();
    assert!(e.contains("ANYCCL_NCCL_BLOCKING=\"yes\"") && e.contains("0 or 1"), "{e}");
}
