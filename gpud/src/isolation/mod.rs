pub mod systemd;
